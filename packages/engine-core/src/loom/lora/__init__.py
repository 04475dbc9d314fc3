"""LoRA adapters on the base model: the PEFT format (:mod:`.peft`, torch-free), the layers' slots
(:mod:`.layers`), the worker's adapters (:mod:`.manager`) and the filesystem resolver plugin
(:mod:`.resolvers`)."""
