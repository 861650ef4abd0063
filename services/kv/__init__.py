"""The KV hand-off between prefill_gpu and decode_fpga.

layout.py (the wire layout and the one wire-dtype table), header.py (the versioned
header the receiver checks), handoff.py (the sender / receiver seam and its state),
and one module per transport: shm.py over arena.py (shared memory, what the services use
on one host), tcp.py with tcp_inbox.py (a TCP stream across Pods or hosts; the inbox routes
decode's incoming connections to their requests) and inprocess.py (plain memory in one
process). slicing.py plans TeraPipe token slices for the network. A new transport goes
beside them."""
