# A boxes fork's dataset entry (its task: forks/boxes.py), appended to data.py as it is (it uses data.py's
# names): 12x12 uint8 images of one bright rectangle on a dark ground, whose box (x1, y1, x2, y2: pixel
# edges, floats) is the target. Crops and flips move the box with its image: the task's augmented_targets.
# The 4 outputs are a box's numbers, no classes: the Source gives their count, not names.
def rectangles(cfg: Config) -> Source:
    g = torch.Generator().manual_seed(3)

    def draw(n: int):
        corner, side = torch.randint(0, 8, (n, 2), generator=g), torch.randint(3, 5, (n, 2), generator=g)
        images = torch.randint(0, 40, (n, 1, 12, 12), generator=g, dtype=torch.uint8)
        for i, ((x, y), (w, h)) in enumerate(zip(corner.tolist(), side.tolist(), strict=True)):
            images[i, 0, y:y + h, x:x + w] = 220
        return images, torch.cat([corner, corner + side], 1).float()

    return Source(draw(cfg.synthetic_size), draw(max(cfg.synthetic_size // 4, 1)), 4, pad=2, flip=True)


DATASETS["rectangles"] = rectangles
