"""SPRINTER's verifier data collection, training and closed-form theory (the verifier itself: `spec/verifier.py`)."""
