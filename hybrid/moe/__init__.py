"""Mixture of experts (issue 32): routers, grouped expert GEMMs, and the token dispatchers of expert
parallelism (experts split across the EP ranks carved out of data parallelism)."""
