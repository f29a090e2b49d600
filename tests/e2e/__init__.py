"""End-to-end tests: torchrun, rendezvous, the runtime, the timeline, the doctor and the emulated cluster."""
