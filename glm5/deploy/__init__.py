"""Tools that read a model without running it for serving: the planner behind `glm5 plan`
(memory and roofline time per device and layout, `glm5.deploy.plan`), the accelerator table it
prices against (`glm5.deploy.chips`), parameter and KV-cache counts (`glm5.deploy.info`), the
offline quantizer and msModelSlim import (`glm5.deploy.quantize`) and ONNX export
(`glm5.deploy.export`). Sits above `glm5.core`; `glm5.parallel` takes its FlashComm token
threshold from here."""
