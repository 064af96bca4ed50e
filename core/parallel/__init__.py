"""core/parallel"""
