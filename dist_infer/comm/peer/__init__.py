"""The peer link: tagged tensor messages between processes that share no communicator (the KV blocks of
live migrations), authenticated with the cluster key both ways."""
