"""Fine-tuning a Llama, one concern per module: ``data`` (documents, batches, a rank's share),
``trainer`` (the optimizer step and the checkpoint it saves and resumes), ``signals`` (stopping
between steps), ``run_directory`` (checkpoints a kill never breaks) and ``cli`` (``python -m
models.llama.train``)."""
