"""(filled in by its issue)"""
__all__ = []
