"""Engine worker: loads, validates and warms a model; executes step plans; samples."""
