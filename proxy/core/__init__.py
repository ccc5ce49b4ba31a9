"""Small pieces every layer uses: models, errors, metrics, single-flight, masking, thread
pools."""
