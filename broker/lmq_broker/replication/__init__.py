"""Replication of ring slots to followers, and failover, on Kubernetes Leases (docs/replication.md)."""
