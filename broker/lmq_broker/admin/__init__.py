"""The admin service (lmq.admin.v1) used by the operator, the reclaim job and the lmq-admin CLI."""
