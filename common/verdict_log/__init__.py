"""The verdict log's format, shared by the router that writes it
(router_service.verdict_log) and the `undercurrent audit` command that reads it
(undercurrent_client.audit): what a record holds (`records`), where it is kept
(`store`: SQLite or PostgreSQL), and replaying an abort offline (`replay`).
docs/rollout.md."""
