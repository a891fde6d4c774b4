"""Tools that build whole programs from the layers below: compile_check AOT-compiles a pod
config's train, decode, RL learner and reshard programs for a TPU topology (models + train +
sampling + rl + parallel), so it sits above all of them (docs/ARCHITECTURE.md)."""
