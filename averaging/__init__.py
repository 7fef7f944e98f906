"""Group averaging: matchmaking, butterfly all-reduce, compression, state sharing (planned)."""
