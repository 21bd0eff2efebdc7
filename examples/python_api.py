"""The Python API takes the same arguments as the CLI.

    python examples/python_api.py
"""
import swiftlite

result = swiftlite.sft(model="tiny-qwen2", dataset=["self-cognition#64"],
                       model_name=["Swifty"], model_author=["Acme"],
                       max_steps=8, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                       learning_rate=5e-3, logging_steps=2, report_to="none",
                       output_dir="output/python-api-demo")
print("run folder:     ", result.output_dir)
print("last checkpoint:", result.last_checkpoint)
print("train loss:     ", result.metrics["train_loss"])
