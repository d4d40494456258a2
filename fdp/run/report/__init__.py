"""What a run reports: a record per logged step and evaluation (``records``: ``Report``), written to
``metrics.jsonl`` with a progress bar and a closing summary (``metrics``), and to the loggers a run asks for
besides (``loggers``: ``trainer.loggers=[tensorboard,csv,mlflow,wandb]``).
"""

from fdp.run.report.loggers import CsvLog, MlflowLog, WandbLog
from fdp.run.report.metrics import MetricsLog, read_metrics
from fdp.run.report.records import Report

__all__ = ["Report", "MetricsLog", "read_metrics", "CsvLog", "MlflowLog", "WandbLog"]
