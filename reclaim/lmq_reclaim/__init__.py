"""Reclaims expired lite topics across all brokers, as a PySpark job."""
