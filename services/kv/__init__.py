"""The KV hand-off between prefill_gpu and decode_fpga: the wire layout, the shared-memory
arena that carries it, and the sender / receiver seam on top."""
