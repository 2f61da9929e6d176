"""What outlives a stream: the policy snapshot, the backends' state, the store, metrics."""
