"""alignpipe's KFP pipeline, its targets, its releases and its command line."""

# The pipeline's name: its KFP name, and the experiment, display name and label of cloud runs.
PIPELINE_NAME = "alignpipe"
