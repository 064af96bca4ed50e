"""Model families: one folder per architecture (`decoder`, `bert`, `t5`, ...), each described to
generic code by a `family.Family`, found by name through `registry.family`."""
