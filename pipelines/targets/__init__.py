"""Where a run goes: placement per target, compiling and submitting, the smoke pipeline."""
