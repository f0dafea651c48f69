"""MQTT 5.0 and 3.1.1 access to lite topics (docs/mqtt.md): a listener beside the gRPC one, over the same dispatcher.

A protocol package like ``protocol``: it may use dispatch and below, never grpc or the v2 stubs.
"""
