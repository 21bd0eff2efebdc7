"""TRL's DPOTrainer with a peft LoRA adapter, the harness' settings (run in TRL's own venv).

  python run_trl_dpo.py MODEL PAIRS.jsonl OUT STEPS BATCH LR BETA
"""
import sys

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

model_dir, pairs, out, steps, batch, lr, beta = sys.argv[1:8]
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
args = DPOConfig(output_dir=out, max_steps=int(steps), per_device_train_batch_size=int(batch),
                 gradient_accumulation_steps=1, learning_rate=float(lr), beta=float(beta),
                 lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.1, max_length=512,
                 gradient_checkpointing=True, logging_steps=1, save_strategy="no",
                 report_to="none", seed=42, use_cpu=True, dataloader_num_workers=0,
                 include_num_input_tokens_seen=False)
peft_config = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                         task_type="CAUSAL_LM")
trainer = DPOTrainer(model=model, args=args, train_dataset=load_dataset("json", data_files=pairs,
                                                                        split="train"),
                     processing_class=tok, peft_config=peft_config)
trainer.train()
trainer.save_model(out)
