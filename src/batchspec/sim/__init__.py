"""`batchspec sim`: acceptance traces replayed under other policies, batch sizes and hardware cost models."""
