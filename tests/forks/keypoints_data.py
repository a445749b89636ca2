# A keypoints fork's dataset entry (its task: forks/keypoints.py), appended to data.py as it is (it uses
# data.py's names): 12x12 uint8 images of a face's three points, each one bright pixel on a dark ground (the
# eyes 220, the nose 140), whose (x, y) pixel columns and rows are the targets, [N, 6] values: the left eye
# is the one on the image's left. Crops and flips move the points with their image: the task's
# augmented_targets.
def face_points(cfg: Config) -> Source:
    g = torch.Generator().manual_seed(11)

    def draw(n: int):
        def place(low: int, high: int, rows: tuple[int, int]):  # columns in [low, high], then rows
            return torch.stack([torch.randint(low, high + 1, (n,), generator=g),
                                torch.randint(*rows, (n,), generator=g)], 1)

        points = torch.cat([place(2, 4, (2, 6)), place(7, 9, (2, 6)), place(5, 6, (6, 10))], 1)
        images = torch.randint(0, 40, (n, 1, 12, 12), generator=g, dtype=torch.uint8)
        for i, (lx, ly, rx, ry, nx, ny) in enumerate(points.tolist()):
            images[i, 0, ly, lx] = images[i, 0, ry, rx] = 220
            images[i, 0, ny, nx] = 140
        return images, points.float()

    names = ["left_x", "left_y", "right_x", "right_y", "nose_x", "nose_y"]
    return Source(draw(cfg.synthetic_size), draw(max(cfg.synthetic_size // 4, 1)), names, pad=2, flip=True)


DATASETS["face_points"] = face_points
