"""Helpers shared by the tests, and the scripts they run as processes (jobs/)."""
