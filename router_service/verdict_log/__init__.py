"""The router's durable record of every verdict and abort: what a record holds
(`records`), where it is kept (`store`: SQLite or PostgreSQL), how it gets
there without holding up scoring (`writer`), and reading it back (`replay`,
`audit`: the `undercurrent audit` command). docs/rollout.md."""
