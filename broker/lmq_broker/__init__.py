"""lmq broker: RocketMQ v2 gRPC endpoint, Light Message Queue store and ready-set dispatcher."""

__version__ = "0.1.0"
