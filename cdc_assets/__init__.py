"""The mirrors: table specs, the hour run and its stages, the decoder, the assets."""
