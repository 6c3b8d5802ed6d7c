"""The fleet planner (`duckctl plan`): predicted decode and prefill rates of a model on a fleet
of ducks beside a GPU host, from the model's shape, the ducks' measured kernel and wire figures
and the GPU's memory (model: the cost model; prefill: long prompts streamed to the GPU; shapes:
the published models' widths; seeds: the seeds' measured cases; cli: calibration out of benchmark
JSON, the command line and its validation against measured runs). docs/plan.md."""
