"""Amazon SageMaker training jobs: the backend (`backend.py`), its AWS clients and errors (`aws.py`),
the botocore model check of each request (`aws_model.py`), CloudWatch logs and console links
(`cloudwatch.py`) and the SageMaker SDK's ModelTrainer view (`model_trainer.py`); the offline wheel
channel, which every backend ships, is `launcher/backends/wheelhouse.py`. Nothing here imports boto3 or sagemaker at module level."""
