import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import flags  # noqa: E402

flags.FLAGS.mark_as_parsed()  # grain reads absl flags outside an absl app
