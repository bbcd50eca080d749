"""The tiny models' builders (single-turn, multi-turn) and the prebuilt builds the
package ships.
"""
