"""The calls users make: `generate`, `generate_ids`, `generate_text`, and the plan that picks a
loop and a driver for each call."""
