"""The embedded DRA scheduler: CEL selectors, the structured-parameters allocator, the pod loop, explanations."""
