"""The Lightning faces of the library: one shared mixin, the Fabric strategy and the Trainer strategy."""
