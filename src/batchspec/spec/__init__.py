"""Speculative decoding: the policies (`policies/`, one module each), the step (propose -> select -> verify), the
acceptance rule, SPRINTER's verifier, run counters and the step-time model."""
