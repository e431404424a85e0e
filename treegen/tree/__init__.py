from treegen.tree.sharing_tree import KVShape, SharingTree, TreeStats

__all__ = ["KVShape", "SharingTree", "TreeStats"]
