"""The runtime both engine services share: the Engine protocol, request state, sampling,
generation loop, request handling behind the gRPC servicers, the profile sweep and metrics."""
