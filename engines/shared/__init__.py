"""What the GPU engines share: extra engine arguments, GPU placement, node groups, ZMQ KV events, block names."""
