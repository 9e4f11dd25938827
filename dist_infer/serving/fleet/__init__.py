"""The front end's fleet: the model instances behind the API as one EngineClient (the Cluster), each
instance's record and connection, where a request goes (dispatch, the prefix index), the hub instances join,
and the wire messages between the front end and each instance's driver."""
