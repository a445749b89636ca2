"""What surrounds the training loop, in small modules of one concern each; a fork never needs to open
them. The front (train.py, evaluate.py, data.py, models.py, task.py, lr_find.py's command line) imports
them; they never import the front: a list of names the front owns is passed down.

files        files written whole (atomically), downloads into a folder
checkpoints  the checkpoint: loaded safely, RNG states, the resume checks, restore
weights      weights from elsewhere into a model: a checkpoint's, a state_dict's, torchvision's
run_folder   one --out-dir, one run: the claim, the lock, --resume auto
processes    the device, torchrun's process group, what the ranks agree on
signals      Ctrl-C, SIGTERM, SIGHUP, SIGUSR1: a flag the training loop reads
stops        how a run saves and stops, in one line that says how to continue
contract     the data against the task and the model, checked at start-up
batches      batches on the device, the image steps, DataLoader workers for files
precision    how the model computes: AMP, --compile (training and evaluation each compiled once), --ema
logs         TensorBoard, summary.json and eval.json, predictions.csv, what a run prints
pictures     image grids and the confusion matrix, drawn as arrays
lr_auto      --lr auto: the rate lr_find.py saved, if it fits this run
export       evaluate.py --export: the model with its input steps inside, ONNX or torch.export, checked
"""
