"""The syncer as a process: the gRPC service and who may call it, the initial upload, the push budget, RPC errors, the HTTP endpoint with its dashboard, and the server that runs them."""
