"""``moeplan profile`` (filled in by the profile stage)."""
