"""The instance side: one model instance's process joining the front end's hub and its driver loop, which
feeds the engine from that one connection. Nothing here imports the HTTP front end."""
