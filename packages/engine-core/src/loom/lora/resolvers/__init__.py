"""LoRA resolvers that ship with loom, each a general plugin of its own (entry points in
loom-engine's ``loom.general_plugins`` group)."""
