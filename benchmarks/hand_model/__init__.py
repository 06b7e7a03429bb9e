"""The hand model: GLM-5.2 on a tpu7x-16 slice, by arithmetic over shapes (docs/hand-model.md).
`cp-runtime bench tpu_model` (tpu_model.py) prints it; tpu_designs.py and tpu_terms.py are the
model, tpu_compiler.py sets it beside what the TPU compiler makes of the same programs."""
