"""The v2 wire edge: the only layer (with admin) that imports grpc or the generated stubs.

Kept empty so that importing ``lmq_broker.protocol.gen.lmq.admin`` does not load the v2 descriptors.
"""
