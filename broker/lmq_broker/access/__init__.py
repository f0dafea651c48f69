"""Users and access control (docs/security.md, "Access control"): pure policy values and their evaluation
(``policy``), their stored form (``document``) and the broker's live copy with its decision cache (``control``).

Below dispatch and storage: no I/O, no grpc; the v2 service, the MQTT listener and the admin service use it.
"""
