"""The runtime both engine services share: the Engine protocol (api.py), request handling in
plain Python (requests.py, runtime.py, generation.py, request_state.py,
sampling.py), the thin gRPC layer over it (service.py, status.py, handoff_wire.py), the
services' start-up (main.py), the profile sweep and metrics."""
