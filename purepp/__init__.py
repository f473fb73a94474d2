"""purepp: pipeline- and data-parallel coordination as pure functions over immutable state."""
