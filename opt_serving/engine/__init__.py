"""The engine: the scheduler over a slot model (scheduler.py: queue, admission into decode slots, steps,
streaming out), which queued requests start now (admission.py), what crosses its boundary (types.py), and a slot
model whose outputs are worked out by hand (fake.py). No JAX and no Ray here: the model is behind
runner.types.SlotModel."""
