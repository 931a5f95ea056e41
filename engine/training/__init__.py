"""Training a DFlash drafter for the target on the target's own outputs; ``run`` is the whole procedure as
one command and ``device.sh`` that command on the GPU machine. README.md here says how the shipped drafter
was trained; ARCHITECTURE.md gives each module its line."""
